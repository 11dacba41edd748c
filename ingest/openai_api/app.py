"""The OpenAI Batch REST API on FastAPI: files in the service's bucket, batches as jobs made by `Intake`.

    POST /v1/files  GET /v1/files  GET /v1/files/{id}  GET /v1/files/{id}/content  DELETE /v1/files/{id}
    POST /v1/batches  GET /v1/batches/{id}  GET /v1/batches  POST /v1/batches/{id}/cancel

Every call carries `Authorization: Bearer <key>`, checked with every body cap before any byte of the body is
read (`guard.RequestGuard`); the key's tenant owns what it creates and sees nothing else (another tenant's file
or batch is 404). Every error is OpenAI's shape, with no internal text or path. A batch's input is validated line
by line at creation (`validation`); its output and error files appear once its job completed, was cancelled
or expired (`results`). Per-tenant limits (`ApiService`) have OpenAI's defaults where OpenAI has one.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException

from ingest.intake import Intake
from ingest.openai_api.guard import RequestGuard
from ingest.openai_api.objects import ApiError, Deleted, FileObject, batch_object, file_object, not_found
from ingest.openai_api.quotas import CHECKS_PER_TENANT, NoSlot, TenantSlots, lock_tenant
from ingest.openai_api.results import (
    ENDED,
    UPLOAD,
    FileInUse,
    add_result_files,
    content,
    delete_expired_files,
    delete_file,
    result_counts,
    settle_readers,
)
from ingest.openai_api.validation import TooManyRows, check_lines
from ingest.policy import API_RESULTS, API_UPLOADS
from ingest.spec import SpecError, validate_request
from storage.api_keys import tenant_of_token
from storage.formats import ENDPOINTS
from storage.job_settings import CELERY, DEFAULT_COMPLETION_WINDOW, DEFAULT_SHARD_SIZE, window_seconds
from storage.models import ApiBatch, ApiFile, Job, JobSource, JobStatus, utcnow
from storage.objectstore import open_file_store
from storage.public_text import public_message
from storage.states import TERMINAL, transition

MAX_UPLOAD_BYTES = 200 << 20  # OpenAI: a batch input file is at most 200 MB
MAX_BATCH_ROWS = 50_000  # OpenAI: a batch holds at most 50,000 requests
MAX_TENANT_BYTES = 100 << 30  # a tenant's stored files, all of them
MAX_BATCHES_IN_PROGRESS = 100  # a tenant's batches not yet ended
MAX_REQUEST_BYTES = 1 << 20  # any body but an upload's
MULTIPART_SLACK = 64 << 10  # an upload's body beyond its file: boundaries, headers, the other fields
FILE_EXPIRY_S = 30 * 86400  # OpenAI: batch files expire after 30 days unless `expires_after` says otherwise
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400  # OpenAI's bounds of `expires_after.seconds`
CLEANUP_INTERVAL_S = 60.0
WINDOW = r"[1-9][0-9]{0,6}[smhd]"  # a completion window: a number and s, m, h or d

log = logging.getLogger("tokenmill.api")


@dataclass
class ApiService:
    """What the API works with. `intake` makes the jobs and hands them to `intake.dispatch`; `cancel(job_id)`
    asks a job to stop (the workers' `cancel_job`); `executor` is who runs the jobs (see `Intake.accept`).
    The limits are per tenant; `max_completion_window` (None: only OpenAI's `24h`) allows other windows up to it."""

    sessions: sessionmaker[Session]
    bucket_uri: str  # uploads go to <bucket>/files/, results to <bucket>/results/<batch id>: the API's alone
    intake: Intake
    cancel: Callable[[str], Any]
    model: str
    served_model_names: list[str] = field(default_factory=list)
    executor: str = CELERY
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    shard_size: int = DEFAULT_SHARD_SIZE
    max_batch_rows: int = MAX_BATCH_ROWS
    max_tenant_bytes: int = MAX_TENANT_BYTES
    max_batches_in_progress: int = MAX_BATCHES_IN_PROGRESS
    max_request_bytes: int = MAX_REQUEST_BYTES
    file_expiry_s: int = FILE_EXPIRY_S  # lifetime of uploads without `expires_after` (0: never expire)
    max_completion_window: str | None = None
    openapi: bool = True  # /openapi.json, behind a key like every path
    cleanup_interval_s: float = CLEANUP_INTERVAL_S
    checks: TenantSlots = field(default_factory=lambda: TenantSlots(CHECKS_PER_TENANT))  # inputs being read

    @property
    def served(self) -> set[str]:
        return {self.model, *self.served_model_names}


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)


class BatchCreate(BaseModel):
    input_file_id: str = Field(max_length=64)
    endpoint: str
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


router = APIRouter(prefix="/v1")


def create_app(service: ApiService) -> RequestGuard:
    """The ASGI app: the routes inside `RequestGuard` (body caps and keys first), and the expired files'
    cleanup running beside them every `cleanup_interval_s`."""
    if service.max_completion_window is not None:  # ValueError now, not a 500 at the first batch
        if not re.fullmatch(WINDOW, service.max_completion_window):
            raise ValueError(f"--max-completion-window {service.max_completion_window!r} is not like 24h or 7d")
        window_seconds(service.max_completion_window)
    app = FastAPI(title="tokenmill: OpenAI Batch API", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if service.openapi else None, lifespan=_cleanup_loop)
    app.state.service = service
    app.include_router(router)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    engine = service.sessions.kw["bind"]
    return RequestGuard(app, lambda method, path: body_limit(service, method, path),
                        lambda token: tenant_of_token(engine, token), is_upload)


def is_upload(method: str, path: str) -> bool:
    return method == "POST" and path.rstrip("/") == "/v1/files"


def body_limit(service: ApiService, method: str, path: str) -> tuple[int, str]:
    if is_upload(method, path):
        return service.max_upload_bytes + MULTIPART_SLACK, "--max-upload-bytes"
    return service.max_request_bytes, "--max-request-bytes"


@asynccontextmanager
async def _cleanup_loop(app: FastAPI):
    service: ApiService = app.state.service
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(service.cleanup_interval_s):
            try:
                delete_expired_files(service.sessions, service.intake.s3)
            except Exception as error:  # the database is down: the next round tries again
                log.warning("the cleanup of expired files failed: %s", error)

    thread = threading.Thread(target=loop, name="tokenmill-api-cleanup", daemon=True)
    thread.start()
    yield
    stop.set()


def api_error(_request: Request, error: ApiError) -> JSONResponse:
    # OpenAI's SDKs retry a 409 unless told not to: ours (an ended batch, a file in use) do not clear by retrying
    headers = {"x-should-retry": "false"} if error.status == 409 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    problem = error.errors()[0]
    where = ".".join(str(part) for part in problem["loc"][1:]) or None
    message = f"{where}: {problem['msg']}" if where else problem["msg"]
    return api_error(request, ApiError(400, message, code="invalid_value", param=where))


def http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Routing's 404 and 405, and the body parser's 400, in OpenAI's words."""
    what = f"{request.method} {request.url.path}"
    message = {404: f"Invalid URL ({what})", 405: f"Invalid method for URL ({what})"}.get(
        error.status_code, "Could not parse the request body." if error.status_code == 400 else "Invalid request.")
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(error.status_code)
    return api_error(request, ApiError(error.status_code, message, code=code))


def server_error(request: Request, _error: Exception) -> JSONResponse:
    """An uncaught exception: logged by the server, never shown to the client."""
    return api_error(request, ApiError(500, "The server had an error while processing your request.",
                                       kind="server_error", code="internal_error"))


def service_of(request: Request) -> ApiService:
    return request.app.state.service


def tenant_of_request(request: Request) -> str:
    """The tenant `RequestGuard` found for the request's key."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        raise ApiError(401, "You didn't provide an API key (Authorization: Bearer <key>).", code="invalid_api_key")
    return tenant


Service = Annotated[ApiService, Depends(service_of)]
Tenant = Annotated[str, Depends(tenant_of_request)]


@router.post("/files", form_limits={"max_files": 1, "max_fields": 3})  # purpose, expires_after[anchor|seconds]
def create_file(service: Service, owner: Tenant, file: Annotated[UploadFile, File()],
                purpose: Annotated[str, Form()],
                expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
                expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None) -> FileObject:
    """The upload was spooled once by the body parser (under the guard's cap); it is streamed from there to
    the bucket, nowhere else."""
    if purpose != "batch":
        raise ApiError(400, f"purpose must be 'batch' here, got {purpose!r}", code="invalid_value", param="purpose")
    lifetime = _expiry(service, expires_anchor, expires_seconds)
    size = file.size if file.size is not None else file.file.seek(0, os.SEEK_END)
    if size > service.max_upload_bytes:
        raise ApiError(413, f"file is larger than the limit of {service.max_upload_bytes:,} bytes "
                            f"(--max-upload-bytes)", code="file_too_large", param="file")
    file_id = f"file-{uuid.uuid4().hex}"
    store, key = open_file_store(f"{service.bucket_uri}/{API_UPLOADS}/{file_id}.jsonl", service.intake.s3)
    now = utcnow()
    row = ApiFile(id=file_id, tenant=owner, purpose=purpose, kind=UPLOAD, bytes=size, created_at=now,
                  filename=_clean_filename(file.filename), uri=store.uri_of(key), ready_at=None,
                  expires_at=None if lifetime is None else now + timedelta(seconds=lifetime))
    with service.sessions.begin() as db:  # the bytes are reserved before they are written: nothing uncounted
        lock_tenant(db, owner)
        stored = db.scalar(select(func.coalesce(func.sum(ApiFile.bytes), 0)).where(
            ApiFile.tenant == owner, ApiFile.deleted_at.is_(None)))
        if stored + size > service.max_tenant_bytes:
            raise ApiError(403, f"storing this file would take your files to {stored + size:,} bytes, over the "
                                f"limit of {service.max_tenant_bytes:,} (--max-tenant-bytes); delete some files first",
                           code="storage_limit_exceeded", param="file")
        db.add(row)
    try:
        file.file.seek(0)
        store.put_stream(key, file.file)
    except BaseException:
        _drop_reservation(service, row)
        raise
    row.ready_at = utcnow()
    with service.sessions.begin() as db:  # if this fails, the cleanup removes the reservation and its object
        db.get(ApiFile, file_id).ready_at = row.ready_at
    return file_object(row)


def _clean_filename(name: str | None) -> str:
    """The upload's own name, without folders or characters a database or a terminal would refuse (NUL...)."""
    cleaned = "".join(ch for ch in os.path.basename(name or "") if ch.isprintable())[:1024]
    return cleaned or "input.jsonl"


def _drop_reservation(service: ApiService, row: ApiFile) -> None:
    """An upload that failed: its reservation is released and whatever part of it was written is removed (or,
    with the database down too, the cleanup does both later)."""
    try:
        with service.sessions.begin() as db:
            delete_file(db, db.get(ApiFile, row.id), service.intake.s3)
    except Exception as error:
        log.warning("could not release the reservation of failed upload %s: %s", row.id, error)


def _expiry(service: ApiService, anchor: str | None, seconds: int | None) -> int | None:
    if anchor is None and seconds is None:
        return service.file_expiry_s or None
    try:
        return ExpiresAfter(anchor=anchor, seconds=seconds).seconds
    except ValueError:
        raise ApiError(400, f"expires_after needs anchor 'created_at' and seconds from {MIN_EXPIRY_S} to "
                            f"{MAX_EXPIRY_S}", code="invalid_value", param="expires_after") from None


@router.get("/files")
def list_files(service: Service, owner: Tenant, purpose: str | None = None, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    query = select(ApiFile).where(ApiFile.tenant == owner, ApiFile.deleted_at.is_(None), ApiFile.ready_at.is_not(None))
    if purpose is not None:
        query = query.where(ApiFile.purpose == purpose)
    newest_first = order == "desc"
    with service.sessions() as db:
        if after is not None:
            cursor = _owned_file(db, owner, after)
            beyond = (ApiFile.created_at < cursor.created_at) if newest_first else (
                ApiFile.created_at > cursor.created_at)
            tie = (ApiFile.id < cursor.id) if newest_first else (ApiFile.id > cursor.id)
            query = query.where(beyond | ((ApiFile.created_at == cursor.created_at) & tie))
        keys = (ApiFile.created_at.desc(), ApiFile.id.desc()) if newest_first else (ApiFile.created_at, ApiFile.id)
        rows = db.scalars(query.order_by(*keys).limit(limit + 1)).all()
    data = [file_object(row).model_dump() for row in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


@router.get("/files/{file_id}")
def retrieve_file(service: Service, owner: Tenant, file_id: str) -> FileObject:
    return file_object(_file(service, owner, file_id))


JSONL_CONTENT = {200: {"description": "The file's bytes (JSON Lines)",
                       "content": {"application/jsonl": {"schema": {"type": "string"}}}}}


@router.get("/files/{file_id}/content", response_class=StreamingResponse, responses=JSONL_CONTENT)
def file_content(service: Service, owner: Tenant, file_id: str) -> StreamingResponse:
    return StreamingResponse(content(_file(service, owner, file_id), service.intake.s3),
                             media_type="application/jsonl")


@router.delete("/files/{file_id}")
def remove_file(service: Service, owner: Tenant, file_id: str) -> Deleted:
    _file(service, owner, file_id)
    settle_readers(service.sessions, service.intake.s3, file_id)
    with service.sessions.begin() as db:
        row = _owned_file(db, owner, file_id, lock=True)  # a batch being made from it waits, or is waited for
        try:
            delete_file(db, row, service.intake.s3)
        except FileInUse as error:
            raise ApiError(409, str(error), code="file_in_use") from None
    return Deleted(id=file_id)


@router.post("/batches")
def create_batch(service: Service, owner: Tenant, body: BatchCreate) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}",
                       code="unsupported_value", param="endpoint")
    _check_window(service, body.completion_window)
    source = _file(service, owner, body.input_file_id)
    if source.kind != UPLOAD:
        raise ApiError(400, f"file {source.id} is a batch's output, not an input", param="input_file_id")
    with service.sessions() as db:  # early, before the input is read; checked again where the batch is written
        _check_batch_limit(service, db, owner)
    try:
        with service.checks.slot(owner):
            checked = _check_input(service, source, body.endpoint)
    except NoSlot:
        raise ApiError(429, f"{service.checks.limit} batches of yours are being checked; retry once one is made",
                       code="rate_limit_exceeded") from None
    job_id = str(uuid.uuid4())

    def add_batch(writer: Session, job: Job) -> None:  # in the job's own transaction: no job without its batch
        lock_tenant(writer, owner)
        if not checked.errors:
            _check_batch_limit(service, writer, owner)
        # a DELETE (or the cleanup) of the input since `_file` above: it committed first, or it waits for this
        # transaction and then finds the batch that reads the file (FileInUse)
        source_row = writer.get(ApiFile, source.id, with_for_update=True)
        if source_row is None or source_row.deleted_at is not None:
            raise not_found("file", source.id)
        if checked.errors:  # refused: the batch exists, failed, with its lines listed (OpenAI's way)
            transition(job, JobStatus.FAILED, error=checked.summary())
        writer.add(ApiBatch(job_id=job.id, tenant=owner, endpoint=body.endpoint, created_at=utcnow(),
                            completion_window=body.completion_window, input_file_id=source.id,
                            metadata_=body.metadata, errors=checked.errors or None,
                            output_expires_after=body.output_expires_after and body.output_expires_after.seconds))

    try:
        request = validate_request(dict(
            input_uri=source.uri, output_uri=f"{service.bucket_uri}/{API_RESULTS}/{job_id}", model=service.model,
            served_model_names=service.served_model_names, openai_output=True, job_id=job_id,
            idempotency_key=f"api-{job_id}", completion_window=body.completion_window, shard_size=service.shard_size))
        new = service.intake.prepare(request, source=JobSource.API.value, source_ref=source.id,
                                     default_key=request.idempotency_key, tenant=owner, executor=service.executor)
        job = service.intake.record(new, with_job=add_batch).job  # a failed one is not handed out
    except SpecError as error:  # told as a tenant may read it: no allow-list prefix, setting or path
        raise ApiError(400, public_message(str(error)), code="invalid_value") from None
    return _batch(service, owner, job.id)


def _check_batch_limit(service: ApiService, db: Session, owner: str) -> None:
    running = db.scalar(select(func.count()).select_from(ApiBatch).join(Job).where(
        ApiBatch.tenant == owner, Job.status.not_in([status.value for status in TERMINAL])))
    if running >= service.max_batches_in_progress:
        raise ApiError(429, f"you have {running} batches in progress, the limit (--max-batches-in-progress); "
                            f"wait for one to end", code="batch_limit_exceeded")


def _check_input(service: ApiService, source: ApiFile, endpoint: str):
    """The input file's lines, checked (the rows and the lines refused with why)."""
    store, key = open_file_store(source.uri, service.intake.s3)
    try:
        with store.open(key) as lines:
            checked = check_lines(lines, endpoint, service.served, service.max_batch_rows)
    except TooManyRows:
        raise ApiError(400, f"the input file has more than {service.max_batch_rows:,} requests, the limit per batch "
                            f"(--max-batch-rows)", code="too_many_requests", param="input_file_id") from None
    if not checked.rows:
        raise ApiError(400, "the input file has no requests", code="empty_file", param="input_file_id")
    return checked


def _check_window(service: ApiService, window: str) -> None:
    if window == DEFAULT_COMPLETION_WINDOW:
        return
    allowed = service.max_completion_window
    if allowed is None or not re.fullmatch(WINDOW, window) or \
            window_seconds(window) > window_seconds(allowed):
        raise ApiError(400, "completion_window must be '24h'" + (f" or at most {allowed!r}" if allowed else "") +
                       " here (--max-completion-window)", code="invalid_value", param="completion_window")


@router.get("/batches/{batch_id}")
def retrieve_batch(service: Service, owner: Tenant, batch_id: str) -> dict[str, Any]:
    return _batch(service, owner, batch_id)


@router.get("/batches")
def list_batches(service: Service, owner: Tenant, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    query = select(ApiBatch.job_id).where(ApiBatch.tenant == owner)
    with service.sessions() as db:
        if after is not None:
            cursor = _owned_batch(db, owner, after)
            query = query.where((ApiBatch.created_at < cursor.created_at) |
                                ((ApiBatch.created_at == cursor.created_at) & (ApiBatch.job_id < cursor.job_id)))
        ids = db.scalars(query.order_by(ApiBatch.created_at.desc(), ApiBatch.job_id.desc()).limit(limit + 1)).all()
    data = [_batch(service, owner, batch_id) for batch_id in ids[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit}


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(service: Service, owner: Tenant, batch_id: str) -> dict[str, Any]:
    with service.sessions() as db:
        _owned_batch(db, owner, batch_id)
    try:
        service.cancel(batch_id)
    except ValueError:  # already ended
        raise ApiError(409, f"batch {batch_id} has ended and cannot be cancelled", code="batch_not_cancellable") \
            from None
    return _batch(service, owner, batch_id)


def _file(service: ApiService, owner: str, file_id: str) -> ApiFile:
    """The tenant's file, read in a session of its own (SQLite: every session holds the write lock)."""
    with service.sessions() as db:
        return _owned_file(db, owner, file_id)


def _owned_file(db: Session, owner: str, file_id: str, lock: bool = False) -> ApiFile:
    row = db.get(ApiFile, file_id, with_for_update=lock)
    if row is None or row.tenant != owner or row.deleted_at is not None or row.ready_at is None:
        raise not_found("file", file_id)
    return row


def _owned_batch(db: Session, owner: str, batch_id: str) -> ApiBatch:
    batch = db.get(ApiBatch, batch_id)
    if batch is None or batch.tenant != owner:
        raise not_found("batch", batch_id)
    return batch


def _batch(service: ApiService, owner: str, batch_id: str) -> dict[str, Any]:
    """The batch object; a batch that completed, was cancelled or expired gets its output and error files the
    first time it is read; an ended batch's request counts are its files' lines."""
    with service.sessions() as db:
        batch = _owned_batch(db, owner, batch_id)
        job = batch.job
    ended = JobStatus(job.status) in ENDED
    if (job.status == JobStatus.COMPLETED or ended) and batch.output_file_id is None and batch.error_file_id is None:
        batch = add_result_files(service.sessions, service.intake.s3, batch, job)
    return batch_object(batch, job, result_counts(service.sessions, batch) if ended else None)
