"""What both batch APIs (OpenAI's `app`, Anthropic's `ingest.anthropic_api`) share: the service they work with and
its per-tenant limits, the route dependencies (the service, the key's tenant), an upload's reservation against the
tenant's storage quota, and the making of a batch's job from its input file through `Intake`, so both kinds of
batch are jobs of one table made one way, under the same quotas.

A tenant's queue limits (`--max-batches-in-progress`, `--max-enqueued-tokens`) are checked where the batch's row
is written, under the tenant's lock (`quotas.lock_tenant`). Over them, OpenAI's batch is made and `failed` at once,
with the limit's code in `errors.data` (as OpenAI's `token_limit_exceeded`: its SDK does not retry a 201), while a
message batch is refused with a 429 that is not retried (Anthropic's way: it has no failed batch)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Annotated, Any

from fastapi import Depends, Request
from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, sessionmaker

from ingest.config import max_enqueued_tokens
from ingest.intake import Intake
from ingest.job_request import JobRequestError, validate_request
from ingest.openai_api.objects import ApiError, not_found
from ingest.openai_api.quotas import CHECKS_PER_TENANT, TenantSlots, lock_tenant
from ingest.openai_api.results import delete_file
from ingest.policy import API_RESULTS
from storage.job_settings import CELERY, DEFAULT_SHARD_SIZE
from storage.models import ApiBatch, ApiFile, Job, JobSource, JobStatus, utcnow
from storage.objectstore import ObjectStore
from storage.public_text import public_message
from storage.states import TERMINAL, transition

MAX_UPLOAD_BYTES = 200 << 20  # OpenAI: a batch input file is at most 200 MB
MAX_BATCH_ROWS = 50_000  # OpenAI: a batch holds at most 50,000 requests
MAX_TENANT_BYTES = 100 << 30  # a tenant's stored files, all of them
MAX_BATCHES_IN_PROGRESS = 100  # a tenant's batches not yet ended
MAX_REQUEST_BYTES = 1 << 20  # any body but an upload's or a message batch's
MAX_MESSAGE_BATCH_REQUESTS = 100_000  # Anthropic: a message batch holds at most 100,000 requests
MAX_MESSAGE_BATCH_BYTES = 256 << 20  # Anthropic: a message batch is at most 256 MB
FILE_EXPIRY_S = 30 * 86400  # OpenAI: batch files expire after 30 days unless `expires_after` says otherwise
CLEANUP_INTERVAL_S = 60.0

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
    max_enqueued_tokens: int = field(default_factory=max_enqueued_tokens)  # per model; 0: no limit
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_message_batch_requests: int = MAX_MESSAGE_BATCH_REQUESTS
    max_message_batch_bytes: int = MAX_MESSAGE_BATCH_BYTES
    file_expiry_s: int = FILE_EXPIRY_S  # lifetime of uploads without `expires_after` (0: never expire)
    max_completion_window: str | None = None
    openapi: bool = True  # /openapi.json, behind a key like every path
    cleanup_interval_s: float = CLEANUP_INTERVAL_S
    checks: TenantSlots = field(default_factory=lambda: TenantSlots(CHECKS_PER_TENANT))  # inputs being read

    @property
    def served(self) -> set[str]:
        return {self.model, *self.served_model_names}


def service_of(request: Request) -> ApiService:
    return request.app.state.service


def tenant_of_request(request: Request) -> str:
    """The tenant `RequestGuard` found for the request's key."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        raise ApiError(401, "You didn't provide an API key (Authorization: Bearer <key>, or x-api-key: <key>).",
                       code="invalid_api_key")
    return tenant


Service = Annotated[ApiService, Depends(service_of)]
Tenant = Annotated[str, Depends(tenant_of_request)]


def reserve_file(service: ApiService, owner: str, row: ApiFile) -> None:
    """Record a file about to be written, its bytes counted against the tenant's `--max-tenant-bytes` (403
    beyond) in the same transaction, so nothing stored is ever uncounted."""
    with service.sessions.begin() as db:
        lock_tenant(db, owner)
        stored = db.scalar(select(func.coalesce(func.sum(ApiFile.bytes), 0)).where(
            ApiFile.tenant == owner, ApiFile.deleted_at.is_(None)))
        if stored + row.bytes > service.max_tenant_bytes:
            raise ApiError(403, f"storing this file would take your files to {stored + row.bytes:,} bytes, over the "
                                f"limit of {service.max_tenant_bytes:,} (--max-tenant-bytes); delete some files first",
                           code="storage_limit_exceeded", param="file")
        db.add(row)


def store_file(service: ApiService, owner: str, row: ApiFile, store: ObjectStore, key: str, source: IO[bytes]) -> None:
    """Write a tenant's new file (`row`, its bytes counted first) from `source` to `key`, and mark it ready; on any
    failure nothing stays counted or stored."""
    reserve_file(service, owner, row)
    try:
        store.put_stream(key, source)
    except BaseException:
        drop_file(service, row.id)
        raise
    row.ready_at = utcnow()
    with service.sessions.begin() as db:  # if this fails, the cleanup removes the reservation and its object
        db.get(ApiFile, row.id).ready_at = row.ready_at


def drop_file(service: ApiService, file_id: str) -> None:
    """A file that failed to be written or used: its reservation is released and whatever part of it was written
    is removed (or, with the database down too, the cleanup does both later)."""
    try:
        with service.sessions.begin() as db:
            delete_file(db, db.get(ApiFile, file_id), service.intake.s3)
    except Exception as error:
        log.warning("could not release the reservation of file %s: %s", file_id, error)


def queue_error(code: str, message: str) -> dict[str, Any]:
    """A queue limit's entry of a failed batch's `errors.data`, as OpenAI's."""
    return {"code": code, "message": message, "param": None, "line": None}


def _not_ended(owner: str) -> ColumnElement[bool]:
    return (ApiBatch.tenant == owner) & Job.status.not_in([status.value for status in TERMINAL])


def over_batch_count(service: ApiService, db: Session, owner: str) -> dict[str, Any] | None:
    """The error when the tenant has `--max-batches-in-progress` batches not yet ended (of both APIs)."""
    running = db.scalar(select(func.count()).select_from(ApiBatch).join(Job).where(_not_ended(owner)))
    if running < service.max_batches_in_progress:
        return None
    return queue_error("batch_limit_exceeded", f"Batch limit reached: {running} of your batches are in progress, "
                                               f"the limit (--max-batches-in-progress). Please try again once some "
                                               f"in_progress batches have been completed.")


def over_enqueued_tokens(service: ApiService, db: Session, owner: str, model: str,
                         tokens: int) -> dict[str, Any] | None:
    """The error when `tokens` more would take the prompt tokens of the tenant's batches of `model` not yet ended
    past `--max-enqueued-tokens` (0: no limit)."""
    limit = service.max_enqueued_tokens
    if not limit:
        return None
    enqueued = db.scalar(select(func.coalesce(func.sum(ApiBatch.enqueued_tokens), 0)).join(Job).where(
        _not_ended(owner), Job.model == model))
    if enqueued + tokens <= limit:
        return None
    return queue_error("token_limit_exceeded", f"Enqueued token limit reached for {model} in organization {owner}. "
                                               f"Limit: {limit:,} enqueued tokens. Please try again once some "
                                               f"in_progress batches have been completed. (This batch: about "
                                               f"{tokens:,} prompt tokens; already enqueued: {enqueued:,}; "
                                               f"--max-enqueued-tokens.)")


def check_batch_limit(service: ApiService, db: Session, owner: str) -> None:
    """429 when the tenant has `--max-batches-in-progress` batches not yet ended: a message batch's early check."""
    if (over := over_batch_count(service, db, owner)) is not None:
        raise ApiError(429, over["message"], code=over["code"])


def batch_page(db: Session, owner: str, cursor: ApiBatch | None, limit: int, which: ColumnElement[bool],
               newer: bool = False) -> tuple[list[str], bool]:
    """The ids of a page of the tenant's batches (`which` of them), newest first: those just older than `cursor`
    (or the newest), or with `newer` those just newer than it; and whether more lie beyond the page."""
    query = select(ApiBatch.job_id).where(ApiBatch.tenant == owner, which)
    keys = (ApiBatch.created_at.desc(), ApiBatch.job_id.desc())
    if cursor is not None and newer:
        query = query.where((ApiBatch.created_at > cursor.created_at) |
                            ((ApiBatch.created_at == cursor.created_at) & (ApiBatch.job_id > cursor.job_id)))
        keys = (ApiBatch.created_at, ApiBatch.job_id)
    elif cursor is not None:
        query = query.where((ApiBatch.created_at < cursor.created_at) |
                            ((ApiBatch.created_at == cursor.created_at) & (ApiBatch.job_id < cursor.job_id)))
    ids = list(db.scalars(query.order_by(*keys).limit(limit + 1)))
    page = ids[:limit]
    return (page[::-1] if newer else page), len(ids) > limit


def record_batch(service: ApiService, owner: str, source: ApiFile, job_id: str, completion_window: str,
                 batch: Callable[[Job], ApiBatch], refused: str | None = None, enqueued_tokens: int = 0,
                 fail_over_limit: bool = True) -> Job:
    """The job of a batch whose input is the tenant's file `source`, made through the intake (its shards, its
    dispatch) with the `ApiBatch` row that `batch(job)` gives, in the job's own transaction: no job without its
    batch. `refused`: why the input was refused; the batch is then made `failed` at once (OpenAI's way).
    `enqueued_tokens`: its prompt tokens, estimated. Over a queue limit it is made `failed` with the limit's error
    (`fail_over_limit`), else refused with a 429."""

    def add_batch(writer: Session, job: Job) -> None:
        lock_tenant(writer, owner)  # the limits' sums and this row: one tenant's batches are written one at a time
        row = batch(job)
        row.enqueued_tokens = enqueued_tokens
        why = refused
        if why is None and (over := over_batch_count(service, writer, owner) or over_enqueued_tokens(
                service, writer, owner, job.model, enqueued_tokens)):
            if not fail_over_limit:
                raise ApiError(429, over["message"], code=over["code"])
            row.errors, why = [over], over["message"]
        # a DELETE (or the cleanup) of the input since it was read: it committed first, or it waits for this
        # transaction and then finds the batch that reads the file (FileInUse)
        source_row = writer.get(ApiFile, source.id, with_for_update=True)
        if source_row is None or source_row.deleted_at is not None:
            raise not_found("file", source.id)
        if why is not None:
            transition(job, JobStatus.FAILED, error=why)
        writer.add(row)

    try:
        request = validate_request(dict(
            input_uri=source.uri, output_uri=f"{service.bucket_uri}/{API_RESULTS}/{job_id}", model=service.model,
            served_model_names=service.served_model_names, openai_output=True, job_id=job_id,
            idempotency_key=f"api-{job_id}", completion_window=completion_window, shard_size=service.shard_size))
        new = service.intake.prepare(request, source=JobSource.API.value, source_ref=source.id,
                                     default_key=request.idempotency_key, tenant=owner, executor=service.executor)
        return service.intake.record(new, with_job=add_batch).job  # a failed one is not handed out
    except JobRequestError as error:  # told as a tenant may read it: no allow-list prefix, setting or path
        raise ApiError(400, public_message(str(error)), code="invalid_value") from None
