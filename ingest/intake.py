"""What every front door does with a valid job spec: store inline rows as a Parquet file, create the job once
(a second arrival with the same idempotency key finds it and changes nothing), and hand a job that still
waits for validation to the workers."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.orm import Session, sessionmaker

from ingest.spec import JobRequest, SpecError
from storage.models import JobStatus
from storage.objectstore import S3Options, open_store
from workers.jobs import Submission, submit


@dataclass
class Intake:
    sessions: sessionmaker[Session]
    s3: S3Options
    dispatch: Callable[[str], None]  # job id -> queued for validation (workers.tasks.dispatch_job)
    inline_uri: str | None = None  # where inline rows are stored

    def accept(self, request: JobRequest, *, source: str, source_ref: str, default_key: str) -> Submission:
        """The job for this request, created or found again; raises SpecError for a spec that cannot run."""
        key = request.idempotency_key or default_key
        if request.rows is not None:
            request = request.model_copy(update={"input_uri": self._store_rows(request.rows, key), "rows": None})
        try:
            submission = submit(self.sessions, request.job_spec(source=source, source_ref=source_ref,
                                                                idempotency_key=key, s3=self.s3), reopen=False)
        except ValueError as error:  # e.g. an unsafe output URI, a job id already taken
            raise SpecError(str(error)) from None
        if submission.job.status == JobStatus.VALIDATING:  # also when an earlier arrival was not handed out
            self.dispatch(submission.job.id)
        return submission

    def _store_rows(self, rows: list[dict], key: str) -> str:
        if not self.inline_uri:
            raise SpecError("inline rows are not accepted here (no TOKENMILL_INLINE_URI); give an input_uri")
        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise SpecError(f"rows: not a table of rows: {error}") from None
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        name = f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.parquet"  # the same message, the same file
        store = open_store(self.inline_uri, self.s3)
        store.put_bytes(name, buffer.getvalue())
        return store.uri_of(name)


def content_key(prefix: str, document: bytes | str) -> str:
    """An idempotency key from content: the same bytes arriving twice are one job."""
    data = document.encode() if isinstance(document, str) else document
    return f"{prefix}-{hashlib.sha256(data).hexdigest()[:40]}"
