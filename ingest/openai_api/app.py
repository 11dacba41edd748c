"""The OpenAI Batch REST API on FastAPI: files in the service's bucket, batches as jobs made by `Intake`.

    POST /v1/files  GET /v1/files  GET /v1/files/{id}  GET /v1/files/{id}/content  DELETE /v1/files/{id}
    POST /v1/batches  GET /v1/batches/{id}  GET /v1/batches  POST /v1/batches/{id}/cancel

The same app serves Anthropic's Message Batches API under /v1/messages (`ingest.anthropic_api`), whose batches
are made through the same `service.record_batch` and kept apart from these routes by their endpoint.

Every call carries `Authorization: Bearer <key>` (or `x-api-key`), checked with every body cap before any byte of
the body is read (`guard.RequestGuard`); the key's tenant owns what it creates and sees nothing else (another
tenant's file or batch is 404). Every error is OpenAI's shape (Anthropic's under /v1/messages), with no internal
text or path. A batch's input is validated line
by line at creation (`validation`); its output and error files appear once its job completed, was cancelled
or expired (`results`). Per-tenant limits (`ApiService`) have OpenAI's defaults where OpenAI has one.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException

from ingest.anthropic_api import routes as anthropic
from ingest.openai_api.guard import RequestGuard
from ingest.openai_api.objects import ApiError, Deleted, FileObject, batch_object, file_object, not_found
from ingest.openai_api.quotas import NoSlot
from ingest.openai_api.results import (
    ENDED,
    MESSAGE_BATCHES,
    OPENAI_PURPOSES,
    UPLOAD,
    FileInUse,
    add_result_files,
    content,
    delete_expired_files,
    delete_file,
    result_counts,
    settle_readers,
)
from ingest.openai_api.service import (
    ApiService,
    Service,
    Tenant,
    batch_page,
    over_batch_count,
    record_batch,
    store_file,
)
from ingest.openai_api.validation import TooManyRows, check_lines
from ingest.policy import API_UPLOADS
from storage.api_keys import tenant_of_token
from storage.formats import ENDPOINTS
from storage.job_settings import DEFAULT_COMPLETION_WINDOW, window_seconds
from storage.models import ApiBatch, ApiFile, JobStatus, utcnow
from storage.objectstore import open_file_store

MULTIPART_SLACK = 64 << 10  # an upload's body beyond its file: boundaries, headers, the other fields
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400  # OpenAI's bounds of `expires_after.seconds`
WINDOW = r"[1-9][0-9]{0,6}[smhd]"  # a completion window: a number and s, m, h or d

log = logging.getLogger("tokenmill.api")


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
    if service.max_enqueued_tokens < 0:
        raise ValueError(f"--max-enqueued-tokens must be 0 (no limit) or more, got {service.max_enqueued_tokens}")
    app = FastAPI(title="tokenmill: OpenAI Batch API and Anthropic Message Batches API", docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json" if service.openapi else None, lifespan=_cleanup_loop)
    app.state.service = service
    app.include_router(router)
    app.include_router(anthropic.router)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    engine = service.sessions.kw["bind"]
    return RequestGuard(app, lambda method, path: body_limit(service, method, path),
                        lambda token: tenant_of_token(engine, token), is_bulk, error_response)


def is_upload(method: str, path: str) -> bool:
    return method == "POST" and path.rstrip("/") == "/v1/files"


def is_bulk(method: str, path: str) -> bool:
    """A request whose body is a batch's input (an upload, a message batch): a tenant has few in flight at once."""
    return is_upload(method, path) or anthropic.is_create(method, path)


def body_limit(service: ApiService, method: str, path: str) -> tuple[int, str]:
    if is_upload(method, path):
        return service.max_upload_bytes + MULTIPART_SLACK, "--max-upload-bytes"
    if anthropic.is_create(method, path):
        return service.max_message_batch_bytes, "--max-message-batch-bytes"
    return service.max_request_bytes, "--max-request-bytes"


def error_response(path: str, error: ApiError) -> tuple[dict[str, Any], dict[str, str]]:
    """The error's body and headers in the words of the API that owns the path: Anthropic's under /v1/messages,
    else OpenAI's (whose SDKs retry a 409 unless told not to: ours, an ended batch or a file in use, do not clear
    by retrying)."""
    if anthropic.serves(path):
        return anthropic.error_response(error)
    return error.body(), {"x-should-retry": "false"} if error.status == 409 else {}


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


def api_error(request: Request, error: ApiError) -> JSONResponse:
    body, headers = error_response(request.url.path, error)
    return JSONResponse(body, status_code=error.status, headers=headers)


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
    file.file.seek(0)
    store_file(service, owner, row, store, key, file.file)  # its bytes reserved before they are written
    return file_object(row)


def _clean_filename(name: str | None) -> str:
    """The upload's own name, without folders or characters a database or a terminal would refuse (NUL...)."""
    cleaned = "".join(ch for ch in os.path.basename(name or "") if ch.isprintable())[:1024]
    return cleaned or "input.jsonl"


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
    query = select(ApiFile).where(ApiFile.tenant == owner, ApiFile.deleted_at.is_(None), ApiFile.ready_at.is_not(None),
                                  ApiFile.purpose.in_(OPENAI_PURPOSES))
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
    with service.sessions() as db:  # early: over it, the batch fails unread; checked again where it is written
        over = over_batch_count(service, db, owner)
    if over is None:
        try:
            with service.checks.slot(owner):
                checked = _check_input(service, source, body.endpoint)
        except NoSlot:
            raise ApiError(429, f"{service.checks.limit} batches of yours are being checked; retry once one is "
                                f"made", code="rate_limit_exceeded") from None
        errors, refused = checked.errors or None, checked.summary() if checked.errors else None
    else:
        checked, errors, refused = None, [over], over["message"]
    job_id = str(uuid.uuid4())
    job = record_batch(service, owner, source, job_id, body.completion_window, lambda job: ApiBatch(
        job_id=job.id, tenant=owner, endpoint=body.endpoint, created_at=utcnow(),
        completion_window=body.completion_window, input_file_id=source.id, metadata_=body.metadata,
        errors=errors, output_expires_after=body.output_expires_after and body.output_expires_after.seconds),
        refused=refused, enqueued_tokens=checked.prompt_tokens if checked else 0)
    return _batch(service, owner, job.id)


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
    with service.sessions() as db:
        cursor = None if after is None else _owned_batch(db, owner, after)
        ids, has_more = batch_page(db, owner, cursor, limit, ApiBatch.endpoint != MESSAGE_BATCHES)
    data = [_batch(service, owner, batch_id) for batch_id in ids]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


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
    if row is None or row.tenant != owner or row.deleted_at is not None or row.ready_at is None or \
            row.purpose not in OPENAI_PURPOSES:  # a message batch's files are seen through its own routes only
        raise not_found("file", file_id)
    return row


def _owned_batch(db: Session, owner: str, batch_id: str) -> ApiBatch:
    batch = db.get(ApiBatch, batch_id)
    if batch is None or batch.tenant != owner or batch.endpoint == MESSAGE_BATCHES:
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
