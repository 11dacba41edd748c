"""Anthropic's Message Batches API, beside OpenAI's Batch API in the same app (`ingest.openai_api.app`):

    POST /v1/messages/batches  GET /v1/messages/batches/{id}  GET /v1/messages/batches
    POST /v1/messages/batches/{id}/cancel  DELETE /v1/messages/batches/{id}  GET /v1/messages/batches/{id}/results

A message batch is made the way an OpenAI batch is: its requests are written as an OpenAI Batch input file (one
chat line each, `messages.openai_line`) under the API's uploads, and that file becomes a job through the same
intake (`record_batch`), with the same tenants, keys and quotas. Its `ApiBatch` row's endpoint is `/v1/messages`,
which keeps it out of OpenAI's `/v1/batches` (and OpenAI's batches out of these routes); its files' purposes keep
them out of `/v1/files`. Over a tenant's queue limits (batches in progress, enqueued tokens per model) a message
batch is refused with Anthropic's 429 `rate_limit_error`, not retried: Anthropic has no failed batch. Its results
are the lines of its job's batch output (or, once cancelled, expired or failed, of its ended output), each told
in Anthropic's words (`messages.individual_response`). Every error under /v1/messages is Anthropic's shape
(`error_response`)."""

from __future__ import annotations

import json
import re
import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from ingest.anthropic_api.messages import (
    UNRUN_RESULTS,
    BatchRequest,
    MessageBatchCreate,
    individual_response,
    openai_line,
)
from ingest.openai_api.objects import ApiError
from ingest.openai_api.results import MESSAGE_BATCHES, UPLOAD, add_result_files, content, delete_file
from ingest.openai_api.service import (
    ApiService,
    Service,
    Tenant,
    batch_page,
    check_batch_limit,
    drop_file,
    record_batch,
    store_file,
)
from ingest.openai_api.validation import estimated_tokens
from ingest.policy import API_UPLOADS
from storage.formats import RowError
from storage.formats.jsonl import parse_value
from storage.job_settings import DEFAULT_COMPLETION_WINDOW
from storage.models import ApiBatch, ApiFile, Job, JobStatus, utcnow
from storage.objectstore import open_file_store
from storage.states import is_terminal

PREFIX = "/v1/messages"
BATCHES = f"{PREFIX}/batches"
ID_PREFIX = "msgbatch_"
INPUT_PURPOSE = "message_batch"  # the batch's requests as OpenAI Batch lines; its results: "message_batch_results"
RESULTS_LIFETIME = timedelta(days=29)  # Anthropic: results are available for 29 days
ENDED_AT = ("completed_at", "failed_at", "cancelled_at", "expired_at")
STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
TRANSIENT = {"rate_limit_exceeded"}  # 429s that clear by waiting (a tenant's requests in flight): the SDK retries

router = APIRouter(prefix=BATCHES)


def serves(path: str) -> bool:
    """Whether a path is this API's: its errors are Anthropic's shape."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def is_create(method: str, path: str) -> bool:
    """`POST /v1/messages/batches`: a body of up to `--max-message-batch-bytes`, counted as an upload in flight."""
    return method == "POST" and path.rstrip("/") == BATCHES


def error_response(error: ApiError) -> tuple[dict[str, Any], dict[str, str]]:
    """Anthropic's error body for an ApiError, and its headers: `x-should-retry: false` on every answer that
    retrying does not change (any 4xx but 408 and a transient 429), so the SDK does not retry it."""
    kind = STATUS_TYPES.get(error.status) or ("api_error" if error.status >= 500 else "invalid_request_error")
    retry = error.status >= 500 or error.status == 408 or (error.status == 429 and error.code in TRANSIENT)
    return {"type": "error", "error": {"type": kind, "message": error.message}}, (
        {} if retry else {"x-should-retry": "false"})


def batch_id_of(job_id: str) -> str:
    return ID_PREFIX + uuid.UUID(job_id).hex


def job_id_of(batch_id: str) -> str | None:
    """The job of a message batch id (`msgbatch_` and the job's UUID in hex); None for any other string."""
    hex_id = batch_id.removeprefix(ID_PREFIX)
    if hex_id == batch_id or not re.fullmatch(r"[0-9a-f]{32}", hex_id):
        return None
    return str(uuid.UUID(hex=hex_id))


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"message batch {batch_id[:80]!r} not found", code="not_found")


def _owned(db, owner: str, batch_id: str) -> ApiBatch:
    job_id = job_id_of(batch_id)
    batch = db.get(ApiBatch, job_id) if job_id else None
    if batch is None or batch.tenant != owner or batch.endpoint != MESSAGE_BATCHES:
        raise not_found(batch_id)
    return batch


def _settled(service: ApiService, owner: str, batch_id: str) -> tuple[ApiBatch, Job]:
    """The tenant's batch and its job; a batch that ended gets its result files the first time it is read."""
    with service.sessions() as db:
        batch = _owned(db, owner, batch_id)
        job = batch.job
    if is_terminal(job.status) and batch.output_file_id is None and batch.error_file_id is None:
        batch = add_result_files(service.sessions, service.intake.s3, batch, job)
    return batch, job


def _files(service: ApiService, batch: ApiBatch) -> dict[str, ApiFile]:
    """The batch's files by kind: its input (`upload`), and once ended `batch_output` and `batch_error`."""
    with service.sessions() as db:
        rows = [db.get(ApiFile, file_id) for file_id in (batch.input_file_id, batch.output_file_id,
                                                         batch.error_file_id) if file_id]
    return {row.kind: row for row in rows if row is not None}


def _time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _object(request: Request, service: ApiService, batch: ApiBatch, job: Job) -> dict[str, Any]:
    """The batch as Anthropic's MessageBatch. As Anthropic's, its requests count as `processing` until it ended;
    then as its results: succeeded, errored, canceled and expired."""
    files = _files(service, batch)
    ended = is_terminal(job.status)
    total = files[UPLOAD].lines if UPLOAD in files else job.requests_total
    counts = {"processing": total, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    results = [files[kind] for kind in ("batch_output", "batch_error") if kind in files]
    if ended:
        lines = {row.kind: row.lines or 0 for row in results}
        codes = batch.error_codes or {}
        unrun = {kind: codes.get(code, 0) for code, kind in UNRUN_RESULTS.items()}
        counts = {"processing": 0, "succeeded": lines.get("batch_output", 0),
                  "errored": lines.get("batch_error", 0) - sum(unrun.values()), **unrun}
    archived = next((row.deleted_at for row in results if row.deleted_at is not None), None)
    batch_id = batch_id_of(job.id)
    status = "ended" if ended else "canceling" if job.status == JobStatus.CANCELLING else "in_progress"
    return {
        "id": batch_id, "type": "message_batch", "processing_status": status, "request_counts": counts,
        "created_at": _time(batch.created_at), "expires_at": _time(job.expires_at),
        "ended_at": _time(next((getattr(job, name) for name in ENDED_AT if getattr(job, name)), None)) if ended
        else None,
        "cancel_initiated_at": _time(job.cancelling_at or job.cancelled_at), "archived_at": _time(archived),
        "results_url": f"{request.base_url}{BATCHES.lstrip('/')}/{batch_id}/results" if ended and not archived
        else None,
    }


def _view(request: Request, service: ApiService, owner: str, batch_id: str) -> dict[str, Any]:
    return _object(request, service, *_settled(service, owner, batch_id))


@router.post("")
def create_message_batch(service: Service, owner: Tenant, request: Request, body: MessageBatchCreate) -> dict[str, Any]:
    if len(body.requests) > service.max_message_batch_requests:
        raise ApiError(400, f"the batch has {len(body.requests):,} requests, over the limit of "
                            f"{service.max_message_batch_requests:,} (--max-message-batch-requests)")
    seen: dict[str, int] = {}
    for index, item in enumerate(body.requests):
        if (first := seen.setdefault(item.custom_id, index)) != index:
            raise ApiError(400, f"requests.{index}.custom_id: {item.custom_id!r} is also the custom_id of "
                                f"requests.{first}; each request of a batch needs its own")
    with service.sessions() as db:  # early, before the input is written; checked again where the batch is written
        check_batch_limit(service, db, owner)
    job_id = str(uuid.uuid4())
    source, tokens = _store_requests(service, owner, job_id, body.requests)
    try:
        job = record_batch(service, owner, source, job_id, DEFAULT_COMPLETION_WINDOW, lambda job: ApiBatch(
            job_id=job.id, tenant=owner, endpoint=MESSAGE_BATCHES, created_at=utcnow(), input_file_id=source.id,
            completion_window=DEFAULT_COMPLETION_WINDOW, output_expires_after=int(RESULTS_LIFETIME.total_seconds())),
            enqueued_tokens=tokens, fail_over_limit=False)
    except BaseException:
        drop_file(service, source.id)  # refused (a limit, a spec): its input goes too
        raise
    return _view(request, service, owner, batch_id_of(job.id))


def _store_requests(service: ApiService, owner: str, job_id: str,
                    requests: list[BatchRequest]) -> tuple[ApiFile, int]:
    """The requests as the batch's input file of OpenAI Batch lines, counted against the tenant's storage like
    an upload, kept as long as the results; and their prompt tokens, estimated as an OpenAI batch's are."""
    file_id = f"file-{uuid.uuid4().hex}"
    store, key = open_file_store(f"{service.bucket_uri}/{API_UPLOADS}/{file_id}.jsonl", service.intake.s3)
    tokens = 0
    with tempfile.SpooledTemporaryFile(max_size=1 << 20) as spool:
        for index, item in enumerate(requests):
            line = openai_line(item)
            if not isinstance(request := parse_value(index, line), RowError):
                tokens += estimated_tokens(request)
            spool.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
        now = utcnow()
        row = ApiFile(id=file_id, tenant=owner, purpose=INPUT_PURPOSE, kind=UPLOAD, bytes=spool.tell(),
                      lines=len(requests), created_at=now, filename=f"{batch_id_of(job_id)}_requests.jsonl",
                      uri=store.uri_of(key), ready_at=None, expires_at=now + RESULTS_LIFETIME)
        spool.seek(0)
        store_file(service, owner, row, store, key, spool)
    return row, tokens


@router.get("/{batch_id}")
def retrieve_message_batch(service: Service, owner: Tenant, request: Request, batch_id: str) -> dict[str, Any]:
    return _view(request, service, owner, batch_id)


@router.get("")
def list_message_batches(service: Service, owner: Tenant, request: Request, before_id: str | None = None,
                         after_id: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict[str, Any]:
    """Newest first; `after_id`: the page after (older than) that batch, `before_id`: the page before (newer)."""
    if before_id is not None and after_id is not None:
        raise ApiError(400, "give before_id or after_id, not both")
    with service.sessions() as db:
        cursor = _owned(db, owner, before_id or after_id) if before_id or after_id else None
        ids, has_more = batch_page(db, owner, cursor, limit, ApiBatch.endpoint == MESSAGE_BATCHES,
                                   newer=before_id is not None)
    data = [_view(request, service, owner, batch_id_of(job_id)) for job_id in ids]
    return {"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.post("/{batch_id}/cancel")
def cancel_message_batch(service: Service, owner: Tenant, request: Request, batch_id: str) -> dict[str, Any]:
    """As Anthropic's: the batch is `canceling` until its requests in flight finish; an ended one is answered as
    it is."""
    with service.sessions() as db:
        job_id = _owned(db, owner, batch_id).job_id
    try:
        service.cancel(job_id)
    except ValueError:  # ended, or finalizing: it ends as it is
        pass
    return _view(request, service, owner, batch_id)


@router.delete("/{batch_id}")
def delete_message_batch(service: Service, owner: Tenant, batch_id: str) -> dict[str, str]:
    """An ended batch, its input and its results; the job stays in the job table."""
    batch, job = _settled(service, owner, batch_id)  # its result files first: the input is then no longer read
    if not is_terminal(job.status):
        raise ApiError(400, f"message batch {batch_id} is still processing: cancel it, and delete it once it ended")
    with service.sessions.begin() as db:
        batch = _owned(db, owner, batch_id)
        for file_id in (batch.output_file_id, batch.error_file_id, batch.input_file_id):
            row = db.get(ApiFile, file_id) if file_id else None
            if row is not None and row.deleted_at is None:
                delete_file(db, row, service.intake.s3)
        db.delete(batch)
    return {"id": batch_id, "type": "message_batch_deleted"}


JSONL_CONTENT = {200: {"description": "The batch's results, one MessageBatchIndividualResponse a line",
                       "content": {"application/x-jsonl": {"schema": {"type": "string"}}}}}


@router.get("/{batch_id}/results", response_class=StreamingResponse, responses=JSONL_CONTENT)
def message_batch_results(service: Service, owner: Tenant, batch_id: str) -> StreamingResponse:
    """Every request once: succeeded ones first, then the others."""
    batch, job = _settled(service, owner, batch_id)
    if not is_terminal(job.status):
        raise ApiError(400, f"message batch {batch_id} is still processing; its results are ready once its "
                            f"processing_status is 'ended'")
    files = _files(service, batch)
    results = [files[kind] for kind in ("batch_output", "batch_error") if kind in files]
    if any(row.deleted_at is not None for row in results):
        raise ApiError(404, f"the results of message batch {batch_id} have expired", code="not_found")

    def lines() -> Iterator[bytes]:
        for row in results:
            for line in content(row, service.intake.s3):
                yield json.dumps(individual_response(json.loads(line)), ensure_ascii=False).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-jsonl")
