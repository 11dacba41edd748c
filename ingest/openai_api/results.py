"""A batch's output and error files, their content, their deletion and the cleanup of expired files.

A completed job's files are the lines of its batch_output.jsonl without and with an error. A cancelled or
expired job keeps its committed shards (`workers.finalize.discard_outputs`): their results and errors, and the rows
of the shards that never committed as batch_cancelled / batch_expired errors, are merged here, once, into
ENDED_OUTPUT_KEY beside them, which the job's own cleanup never touches. So an ended batch's input stays until its
result files exist (`settle_readers`)."""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.formats import (
    BATCH_OUTPUT_KEY,
    InputError,
    InputReader,
    Request,
    RowError,
    batch_output_line,
    line_error,
    open_input,
    read_part,
    write_jsonl,
)
from storage.models import ApiBatch, ApiFile, Job, JobStatus, ShardStatus, utcnow
from storage.objectstore import S3Options, open_file_store, open_store
from storage.states import is_terminal

log = logging.getLogger("tokenmill.api")

UPLOAD = "upload"
CHUNK = 1 << 20
OUTPUT_KINDS = {"batch_output": False, "batch_error": True}  # kind -> holds the lines with an error
ENDED_OUTPUT_KEY = "ended_batch_output.jsonl"
ENDED = (JobStatus.CANCELLED, JobStatus.EXPIRED)
MESSAGE_BATCHES = "/v1/messages"  # the endpoint of an Anthropic message batch (`ingest.anthropic_api`)
OPENAI_PURPOSES = ("batch", "batch_output")  # the files OpenAI's /v1/files shows: a message batch's are its own


def content(row: ApiFile, s3: S3Options) -> Iterator[bytes]:
    """An uploaded file's bytes; for a batch's output or error file, its lines of the batch output (the error
    file's: those of a failed request, an HTTP error `response` or a top-level `error`)."""
    store, key = open_file_store(row.uri, s3)
    with store.open(key) as source:
        if row.kind == UPLOAD:
            while chunk := source.read(CHUNK):
                yield chunk
            return
        wanted = OUTPUT_KINDS[row.kind]
        for line in source:
            if line.strip() and (line_error(json.loads(line)) is not None) == wanted:
                yield line


def add_result_files(sessions: sessionmaker[Session], s3: S3Options, batch: ApiBatch, job: Job) -> ApiBatch:
    """The output and error files of a batch whose job completed, was cancelled or expired (or, for a message
    batch, failed), once: a second caller finds the first one's rows. The batch keeps its error lines' codes."""
    if job.status == JobStatus.COMPLETED:
        uri = f"{job.output_uri.rstrip('/')}/{BATCH_OUTPUT_KEY}"
    else:
        uri = _write_ended_output(sessions, job)
    store, key = open_file_store(uri, s3)
    counts = {kind: 0 for kind in OUTPUT_KINDS}
    sizes = dict(counts)
    codes: Counter[str] = Counter()
    if store.exists(key):
        with store.open(key) as source:
            for line in source:
                if line.strip():
                    error = line_error(json.loads(line))
                    kind = "batch_error" if error is not None else "batch_output"
                    counts[kind] += 1
                    sizes[kind] += len(line)
                    if error is not None:
                        codes[str(error.get("code"))] += 1
    now = utcnow()  # each file's lifetime counts from its own creation, as OpenAI's does
    expires = None if batch.output_expires_after is None else now + timedelta(seconds=batch.output_expires_after)
    purpose = "message_batch_results" if batch.endpoint == MESSAGE_BATCHES else "batch_output"
    files = {kind: ApiFile(id=f"file-{uuid.uuid5(uuid.NAMESPACE_URL, f'{job.id}/{kind}').hex}", tenant=batch.tenant,
                           purpose=purpose, kind=kind, uri=uri, bytes=sizes[kind], lines=counts[kind],
                           filename=f"{batch.job_id}_{'error' if errors else 'output'}.jsonl", created_at=now,
                           ready_at=now, expires_at=expires)
             for kind, errors in OUTPUT_KINDS.items() if counts[kind]}
    try:
        with sessions.begin() as db:
            db.add_all(files.values())
            batch = db.get(ApiBatch, batch.job_id)
            batch.output_file_id = files["batch_output"].id if "batch_output" in files else None
            batch.error_file_id = files["batch_error"].id if "batch_error" in files else None
            batch.error_codes = dict(codes)
    except IntegrityError:  # another request added them first
        with sessions() as db:
            batch = db.get(ApiBatch, batch.job_id)
    return batch


def result_counts(sessions: sessionmaker[Session], batch: ApiBatch) -> tuple[int, int] | None:
    """(completed, failed) as the lines of an ended batch's files; None for a batch without them."""
    ids = [file_id for file_id in (batch.output_file_id, batch.error_file_id) if file_id]
    if not ids:
        return None
    with sessions() as db:
        lines = {row.kind: row.lines or 0 for row in db.scalars(select(ApiFile).where(ApiFile.id.in_(ids)))}
    return lines.get("batch_output", 0), lines.get("batch_error", 0)


def _write_ended_output(sessions: sessionmaker[Session], job: Job) -> str:
    """Every row of the input once, in input order, as OpenAI Batch output lines: a committed shard's results
    and errors; a row of a shard that never committed, or of a job ended before it was planned, as a
    `batch_cancelled` / `batch_expired` error (or its own input error), as OpenAI lists the requests a batch did
    not run."""
    store = open_store(job.output_uri, job.settings.s3)
    with sessions() as db:
        shards = sorted(repo.get_job(db, job.id).shards, key=lambda s: s.index)
    readers: list[InputReader] = []

    def unrun(start: int, end: int | None) -> Iterator[dict]:
        if not readers:
            readers.append(open_input(*open_file_store(job.input_uri, job.settings.s3), job.settings.limits,
                                      pin=job.settings.input_fingerprint, task=job.settings.task))
        code, message = UNRUN_CODES[JobStatus(job.status)]
        for row in readers[0].read(start, readers[0].num_rows if end is None else end):
            yield batch_output_line(job.id, job.model, _unrun_record(row, code, message))

    def lines() -> Iterator[dict]:
        if not shards:  # ended before it was planned: every row of its input (checked when the batch was made)
            try:
                yield from unrun(0, None)
            except InputError:  # not readable as a batch input after all: nothing ran, nothing to list
                pass
        for shard in shards:
            if shard.status != ShardStatus.COMPLETED:
                yield from unrun(shard.row_start, shard.row_end)
                continue
            results = read_part(store, shard.output_key).to_pylist()
            with sessions() as db:
                errors = [{"custom_id": e.custom_id, "row_index": e.row_index, "code": e.code, "message": e.message}
                          for e in repo.failed_rows(db, job.id, shard.index)]
            merged = heapq.merge(results, errors, key=lambda r: r["row_index"])
            for _, records in itertools.groupby(merged, key=lambda r: r["row_index"]):
                yield batch_output_line(job.id, job.model, list(records))

    try:
        write_jsonl(store, ENDED_OUTPUT_KEY, lines())
    finally:
        for reader in readers:
            reader.close()
    return store.uri_of(ENDED_OUTPUT_KEY)


UNRUN_CODES = {JobStatus.CANCELLED: ("batch_cancelled", "the batch was cancelled before this request ran"),
               JobStatus.EXPIRED: ("batch_expired", "the batch expired before this request ran"),
               JobStatus.FAILED: ("batch_failed", "the batch failed before this request ran")}


def _unrun_record(row: Request | RowError, code: str, message: str) -> dict:
    if isinstance(row, RowError):  # a row that could not have run either: its own error
        return {"custom_id": row.custom_id, "row_index": row.row, "code": row.code, "message": row.message}
    return {"custom_id": row.custom_id, "row_index": row.row, "code": code, "message": message}


class FileInUse(ValueError):
    pass


def delete_file(db: Session, row: ApiFile, s3: S3Options) -> None:
    """Mark the file deleted and remove what only it used: an upload's object; with a batch's last live
    result file, the batch's results (its output prefix). FileInUse for the input of a running batch."""
    if row.kind == UPLOAD:
        readers = db.scalars(select(ApiBatch).where(ApiBatch.input_file_id == row.id)).all()
        if any(not is_terminal(batch.job.status) for batch in readers):
            raise FileInUse(f"file {row.id} is the input of a batch still running")
        if any(_results_pending(batch) for batch in readers):
            raise FileInUse(f"file {row.id} is the input of an ended batch whose result files are being written")
    row.deleted_at = utcnow()
    if row.kind == UPLOAD:
        store, key = open_file_store(row.uri, s3)
        store.delete(key)
        return
    batch = db.scalar(select(ApiBatch).where(or_(ApiBatch.output_file_id == row.id, ApiBatch.error_file_id == row.id)))
    siblings = [db.get(ApiFile, file_id) for file_id in (batch.output_file_id, batch.error_file_id)
                if batch is not None and file_id and file_id != row.id]
    if batch is not None and all(sibling is None or sibling.deleted_at is not None for sibling in siblings):
        store = open_store(batch.job.output_uri, batch.job.settings.s3)
        for key in store.list(""):
            store.delete(key)


def _results_pending(batch: ApiBatch) -> bool:
    """An ended batch with rows whose result files are not written yet (they list its unrun rows from its input)."""
    return JobStatus(batch.job.status) in ENDED and batch.output_file_id is None and batch.error_file_id is None


def settle_readers(sessions: sessionmaker[Session], s3: S3Options, file_id: str) -> None:
    """Before an upload is deleted: the result files of the ended batches that read it and lack them."""
    with sessions() as db:
        pending = [(batch, batch.job) for batch in db.scalars(select(ApiBatch).where(ApiBatch.input_file_id == file_id))
                   if _results_pending(batch)]
    for batch, job in pending:
        add_result_files(sessions, s3, batch, job)


ABANDONED_UPLOAD_S = 3600  # an upload still not written this long after its reservation: its writer died


def delete_expired_files(sessions: sessionmaker[Session], s3: S3Options, now: datetime | None = None) -> int:
    """Delete the files whose `expires_at` passed (an upload a running batch still reads waits for it to end),
    and the reservations of uploads abandoned mid-write (with whatever of them was written). Returns how many."""
    now = now or utcnow()
    expired = and_(ApiFile.expires_at.is_not(None), ApiFile.expires_at <= now)
    abandoned = and_(ApiFile.ready_at.is_(None), ApiFile.created_at <= now - timedelta(seconds=ABANDONED_UPLOAD_S))
    with sessions() as db:
        due = db.scalars(select(ApiFile.id).where(ApiFile.deleted_at.is_(None), or_(expired, abandoned))).all()
    deleted = 0
    for file_id in due:
        try:
            settle_readers(sessions, s3, file_id)
            with sessions.begin() as db:
                row = db.get(ApiFile, file_id, with_for_update=True)
                if row is not None and row.deleted_at is None:
                    delete_file(db, row, s3)
                    deleted += 1
        except FileInUse:
            continue
        except Exception as error:  # the store or the database is down: the next round tries again
            log.warning("could not delete expired file %s: %s", file_id, error)
    return deleted
