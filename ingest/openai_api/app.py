"""The OpenAI Batch REST API on FastAPI: files in the service's bucket, batches as jobs made by `Intake`.

    POST /v1/files  GET /v1/files/{id}  GET /v1/files/{id}/content  DELETE /v1/files/{id}
    POST /v1/batches  GET /v1/batches/{id}  GET /v1/batches  POST /v1/batches/{id}/cancel

Every call carries `Authorization: Bearer <key>`; the key's tenant owns what it creates and sees nothing else
(another tenant's file or batch is 404). A batch's output and error files appear once its job completed: the
lines of the job's batch_output.jsonl without and with an error.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from ingest.intake import Intake
from ingest.openai_api.objects import ApiError, Deleted, FileObject, batch_object, file_object, not_found
from ingest.spec import SpecError, validate_request
from storage.api_keys import tenant_of
from storage.formats import BATCH_OUTPUT_KEY, ENDPOINTS
from storage.job_settings import CELERY, DEFAULT_COMPLETION_WINDOW, DEFAULT_SHARD_SIZE
from storage.models import ApiBatch, ApiFile, Job, JobSource, utcnow
from storage.objectstore import S3Options, open_file_store
from storage.states import is_terminal

MAX_UPLOAD_BYTES = 200 << 20  # OpenAI's limit for a batch input file
CHUNK = 1 << 20
UPLOAD = "upload"
OUTPUT_KINDS = {"batch_output": False, "batch_error": True}  # kind -> holds the lines with an error


@dataclass
class ApiService:
    """What the API works with. `intake` makes the jobs and hands them to `intake.dispatch`; `cancel(job_id)`
    asks a job to stop (the workers' `cancel_job`); `executor` is who runs the jobs (see `Intake.accept`)."""

    sessions: sessionmaker[Session]
    bucket_uri: str  # uploads go to <bucket>/files/, results to <bucket>/results/<batch id>
    intake: Intake
    cancel: Callable[[str], Any]
    model: str
    served_model_names: list[str] = field(default_factory=list)
    executor: str = CELERY
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    shard_size: int = DEFAULT_SHARD_SIZE


class BatchCreate(BaseModel):
    input_file_id: str = Field(max_length=64)
    endpoint: str
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)


BEARER = HTTPBearer(auto_error=False)
router = APIRouter(prefix="/v1")


def create_app(service: ApiService) -> FastAPI:
    app = FastAPI(title="tokenmill: OpenAI Batch API", docs_url=None, redoc_url=None)
    app.state.service = service
    app.include_router(router)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)

    @app.middleware("http")
    async def refuse_large_uploads(request: Request, call_next):
        """Before the body is read: an upload that says it is over the limit (the copy counts the rest)."""
        declared = request.headers.get("content-length", "")
        if request.url.path == "/v1/files" and declared.isdigit() and int(declared) > service.max_upload_bytes + CHUNK:
            return api_error(request, _too_large(service.max_upload_bytes))
        return await call_next(request)

    return app


def api_error(_request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    problem = error.errors()[0]
    where = ".".join(str(part) for part in problem["loc"][1:]) or None
    message = f"{where}: {problem['msg']}" if where else problem["msg"]
    return api_error(request, ApiError(400, message, code="invalid_value", param=where))


def service_of(request: Request) -> ApiService:
    return request.app.state.service


def tenant_of_request(service: Annotated[ApiService, Depends(service_of)],
                      credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> str:
    owner = None
    if credentials is not None:
        with service.sessions() as db:
            owner = tenant_of(db, credentials.credentials)
    if owner is None:
        raise ApiError(401, "Incorrect API key provided." if credentials else
                       "You didn't provide an API key (Authorization: Bearer <key>).", code="invalid_api_key")
    return owner


Service = Annotated[ApiService, Depends(service_of)]
Tenant = Annotated[str, Depends(tenant_of_request)]


@router.post("/files")
def create_file(service: Service, owner: Tenant, file: Annotated[UploadFile, File()],
                purpose: Annotated[str, Form()]) -> FileObject:
    if purpose != "batch":
        raise ApiError(400, f"purpose must be 'batch' here, got {purpose!r}", code="invalid_value", param="purpose")
    file_id = f"file-{uuid.uuid4().hex}"
    store, key = open_file_store(f"{service.bucket_uri}/files/{file_id}.jsonl", service.intake.s3)
    size = _upload(file, store, key, service.max_upload_bytes)
    row = ApiFile(id=file_id, tenant=owner, purpose=purpose, kind=UPLOAD, bytes=size, created_at=utcnow(),
                  filename=os.path.basename(file.filename or "input.jsonl")[:1024], uri=store.uri_of(key))
    with service.sessions.begin() as db:
        db.add(row)
    return file_object(row)


@router.get("/files/{file_id}")
def retrieve_file(service: Service, owner: Tenant, file_id: str) -> FileObject:
    return file_object(_file(service, owner, file_id))


@router.get("/files/{file_id}/content")
def file_content(service: Service, owner: Tenant, file_id: str) -> StreamingResponse:
    return StreamingResponse(_content(_file(service, owner, file_id), service.intake.s3),
                             media_type="application/jsonl")


@router.delete("/files/{file_id}")
def delete_file(service: Service, owner: Tenant, file_id: str) -> Deleted:
    with service.sessions.begin() as db:
        row = _owned_file(db, owner, file_id)
        readers = db.scalars(select(Job).join(ApiBatch).where(ApiBatch.input_file_id == file_id)).all()
        if any(not is_terminal(job.status) for job in readers):
            raise ApiError(409, f"file {file_id} is the input of a batch still running", code="file_in_use")
        row.deleted_at = utcnow()
        if row.kind == UPLOAD:
            store, key = open_file_store(row.uri, service.intake.s3)
            store.delete(key)
    return Deleted(id=file_id)


@router.post("/batches")
def create_batch(service: Service, owner: Tenant, body: BatchCreate) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}",
                       code="unsupported_value", param="endpoint")
    source = _file(service, owner, body.input_file_id)
    if source.kind != UPLOAD:
        raise ApiError(400, f"file {source.id} is a batch's output, not an input", param="input_file_id")
    job_id = str(uuid.uuid4())
    try:
        request = validate_request(dict(
            input_uri=source.uri, output_uri=f"{service.bucket_uri}/results/{job_id}", model=service.model,
            served_model_names=service.served_model_names, openai_output=True, job_id=job_id,
            idempotency_key=f"api-{job_id}", completion_window=body.completion_window, shard_size=service.shard_size))
        submission = service.intake.accept(request, source=JobSource.API.value, source_ref=source.id,
                                           default_key=request.idempotency_key, tenant=owner,
                                           executor=service.executor)
    except SpecError as error:
        raise ApiError(400, str(error), code="invalid_value") from None
    with service.sessions.begin() as writer:
        writer.add(ApiBatch(job_id=submission.job.id, tenant=owner, endpoint=body.endpoint, created_at=utcnow(),
                            completion_window=body.completion_window, input_file_id=source.id,
                            metadata_=body.metadata))
    return _batch(service, owner, submission.job.id)


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
    except ValueError as error:  # already finished
        raise ApiError(409, str(error), code="batch_not_cancellable") from None
    return _batch(service, owner, batch_id)


def _upload(file: UploadFile, store, key: str, limit: int) -> int:
    """Copy the upload to the bucket through a local temp file, counting bytes; 413 past the limit."""
    size = 0
    with tempfile.NamedTemporaryFile(prefix="tokenmill-upload-") as spool:
        while chunk := file.file.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            spool.write(chunk)
        spool.flush()
        store.put_file(key, spool.name)
    return size


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"file is larger than the limit of {limit} bytes (--max-upload-bytes)",
                    code="file_too_large", param="file")


def _file(service: ApiService, owner: str, file_id: str) -> ApiFile:
    """The tenant's file, read in a session of its own (SQLite: every session holds the write lock)."""
    with service.sessions() as db:
        return _owned_file(db, owner, file_id)


def _owned_file(db: Session, owner: str, file_id: str) -> ApiFile:
    row = db.get(ApiFile, file_id)
    if row is None or row.tenant != owner or row.deleted_at is not None:
        raise not_found("file", file_id)
    return row


def _owned_batch(db: Session, owner: str, batch_id: str) -> ApiBatch:
    batch = db.get(ApiBatch, batch_id)
    if batch is None or batch.tenant != owner:
        raise not_found("batch", batch_id)
    return batch


def _batch(service: ApiService, owner: str, batch_id: str) -> dict[str, Any]:
    """The batch object; a completed batch gets its output and error files the first time it is read."""
    with service.sessions() as db:
        batch = _owned_batch(db, owner, batch_id)
        job = batch.job
    if job.status == "completed" and batch.output_file_id is None and batch.error_file_id is None:
        batch = _add_result_files(service, batch, job)
    return batch_object(batch, job)


def _add_result_files(service: ApiService, batch: ApiBatch, job: Job) -> ApiBatch:
    uri = f"{job.output_uri.rstrip('/')}/{BATCH_OUTPUT_KEY}"
    files = {}
    for kind, errors in OUTPUT_KINDS.items():
        if (job.requests_failed if errors else job.requests_completed) == 0:
            continue
        file_id = f"file-{uuid.uuid5(uuid.NAMESPACE_URL, f'{job.id}/{kind}').hex}"
        files[kind] = ApiFile(id=file_id, tenant=batch.tenant, purpose="batch_output", kind=kind, uri=uri,
                              filename=f"{batch.job_id}_{'error' if errors else 'output'}.jsonl", created_at=utcnow())
        files[kind].bytes = sum(len(chunk) for chunk in _content(files[kind], service.intake.s3))
    try:
        with service.sessions.begin() as db:
            db.add_all(files.values())
            batch = db.get(ApiBatch, batch.job_id)
            batch.output_file_id = files["batch_output"].id if "batch_output" in files else None
            batch.error_file_id = files["batch_error"].id if "batch_error" in files else None
    except IntegrityError:  # another request added them first
        with service.sessions() as db:
            batch = db.get(ApiBatch, batch.job_id)
    return batch


def _content(row: ApiFile, s3: S3Options) -> Iterator[bytes]:
    """An uploaded file's bytes; for a batch's output or error file, its lines of batch_output.jsonl."""
    store, key = open_file_store(row.uri, s3)
    with store.open(key) as source:
        if row.kind == UPLOAD:
            while chunk := source.read(CHUNK):
                yield chunk
            return
        wanted = OUTPUT_KINDS[row.kind]
        for line in source:
            if line.strip() and (json.loads(line).get("error") is not None) == wanted:
                yield line
